"""Moving bytes: host and device memory, the UVA view, one buffer class per tier, one-shot copies."""
