"""A stage worker: the process that holds a layer range and the loop that feeds it. Imports
core, engine, net and weights (a worker without the model file fetches its range's bytes)."""
