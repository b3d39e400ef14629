"""Small rules every package shares (no graphcap, model or attention imports): value checks."""
