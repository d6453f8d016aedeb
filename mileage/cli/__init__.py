"""The `mileage` command line."""
