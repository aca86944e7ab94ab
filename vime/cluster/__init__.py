"""Ray for the run: starting or joining a cluster, placement groups and node addresses (`placement`), and
the remote calls that fail fast naming the actor that died (`remote`), and what every actor sets up in its own
process (`process`)."""
