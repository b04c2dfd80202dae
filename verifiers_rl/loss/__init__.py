"""Stage 7, loss: one micro-batch through the policy (`forward`), per-token logprobs computed in vocabulary chunks
(`logprobs`), and the policy-gradient losses with their importance ratios and clipping (`losses`)."""
