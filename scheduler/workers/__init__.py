"""The workers as the scheduler sees them: trainer and sampler handles, routing, membership and registration.
Builds on db and settings only."""
