"""A stage worker: the process that holds a layer range and the loop that feeds it. Imports
core, engine and net."""
