"""Planning a run before anything starts: the serving plan (engine, mode, sync backend, LoRA sync, who pauses, the
memory and thread splits: `serving.py`), the GPUs each process gets (`devices.py`), and a shared GPU's memory
split (`memory.py`). Pure functions of the settings and the machine, so `vf-rl --dry-run` prints the same plan
the run then follows."""
