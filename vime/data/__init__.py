"""Prompts and rewards: the built-in tasks (`tasks`) and the dataset a run samples from (`dataset`)."""
