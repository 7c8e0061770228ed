"""Development tooling: a local broker, the tiny model, the demos. No runtime module imports it."""
