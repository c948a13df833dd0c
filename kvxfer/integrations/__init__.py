"""Engine integrations: connectors that let real engines move KV through kvxfer."""
