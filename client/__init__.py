"""kvxfer.client: engine-side helpers and the client of a kvxfer sidecar."""
