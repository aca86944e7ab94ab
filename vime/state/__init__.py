"""A run's state on disk: checkpoints and resume (`checkpoint`, with the Hugging Face export) and the run
directory that refuses to overwrite a run and resumes one with its own config (`rundir`)."""
