"""Weights over the mesh: a holder of a model file serves its bytes, and a worker without
the file fetches only its range's, each tensor checked against the holder's manifest,
into a sparse file with the original's layout. Imports core, engine and net."""
