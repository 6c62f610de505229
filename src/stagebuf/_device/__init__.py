"""Device primitives: host and device memory, the UVA view."""
