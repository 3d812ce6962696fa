"""What crosses a link: the protocol's messages, CURVE security, heartbeats and addresses.
Imports core only."""
