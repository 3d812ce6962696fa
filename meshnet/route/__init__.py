"""The coordinator side: the route over stage workers, the tracker that chooses it, and the
sessions on it. Imports core and net, never engine or stage: a coordinator needs no model."""
