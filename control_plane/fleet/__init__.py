"""Device fleet: attributes devices report and the selectors rollouts target them with."""
