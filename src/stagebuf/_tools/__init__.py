"""Tools beside the package face: doctor and the command line."""
