"""The shared vocabulary of every room: errors, the log, types, sealing, dtype conversion, tiers."""
