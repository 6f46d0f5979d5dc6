"""Development tools, not part of the served application: the tiny model generator, `make serve`'s ready line."""
