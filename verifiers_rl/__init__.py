"""verifiers-rl: train language models against `verifiers` environments with RL.

Data flow (see docs/architecture.md):
config -> launch -> serve <-> client -> rollouts -> batch -> loss -> sync
"""

__version__ = "0.1.0"
