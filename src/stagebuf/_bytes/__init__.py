"""Moving bytes: one buffer class per tier, the tier ladder, one-shot copies."""
