"""Stage 5, rollouts: grouped rollouts generated through verifiers environments. The orchestrator keeps groups
in flight ahead of training (in a child process that imports the user's environment), mixes several environments
by ratio, filters groups by difficulty, and turns verifiers' outputs into typed `Rollout`s with rewards and
per-stage progress."""
