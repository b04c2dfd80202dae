"""Stage 3, serving: the trainer's side of the inference server. Start it (`launcher`, `layout`), find it
(`discovery`), talk to it over the vLLM-compatible HTTP protocol (`client`, `auth`, `net`, `limits`), and own it
for a run (`session`: spawn, health, shutdown)."""
