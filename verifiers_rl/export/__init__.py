"""The trained model, ready to use: `final/` folders (merged model, adapter, model card), checkpoints opened for
export, and the push to the Hugging Face hub. `verifiers_rl.trainer.final` writes a run's `final/`;
`vf-rl export` (`verifiers_rl.scripts.export`) does the same for any checkpoint."""
