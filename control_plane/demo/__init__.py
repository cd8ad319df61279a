"""Demo and sample-model tooling (not product code): `skiff demo`, models for tests and benches."""
