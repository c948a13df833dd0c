"""kvxfer.server: the sidecar process (`kvxfer-server`)."""
