"""The meshnet command: the click group, its options and rendering, and the terminal chat.
Imports anything."""
