"""Starting routes of local worker processes (LocalCluster). Imports core, engine, net and
route."""
