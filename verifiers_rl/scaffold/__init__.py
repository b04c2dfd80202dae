"""Workspace templates for `vf-rl setup` (the repo's configs/ links here, so there is one copy)."""
