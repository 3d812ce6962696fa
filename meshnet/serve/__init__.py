"""meshnet serve: the OpenAI-compatible HTTP app over a route. Imports core, engine, net,
route and launch."""
