"""Stage 6, batch: rollouts become training data. Token samples with their masks (`samples`), group-relative
advantages (`advantages`), token-budgeted micro-batches (`microbatches`), and shared-prefix packing of a group's
turns (`prefix_sharing`). Pure tensor functions."""
