"""The run's typed config (`schema`, Hydra structured configs), the checks run before any engine starts
(`preflight`), and the cluster layout: placement of trainer ranks and engines, each engine's weight path
(`layout`)."""
