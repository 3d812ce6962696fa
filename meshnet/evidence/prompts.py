"""The prompts meshnet checks and measures itself on, written once: meshnet accept, bench,
drift, the stock-reference check of a numerics class, tools/netns_check.py and the tests."""

# Short continuations, one per session: accept's checks (parity, isolation, cancel, a
# killed worker) and the two-namespace check
SHORT = [
    "The old lighthouse keeper climbed the stairs every night, and",
    "A recipe for bread needs flour, water, salt and",
    "In 1969 the first astronauts landed on the Moon, and",
    "The three laws of thermodynamics say that",
]

# Prose of 30-40 tokens, decoded at length: bench's configurations and drift
PROSE = [
    "In the far north, where the winters last for most of the year, a small village of fishermen kept an old "
    "tradition: every evening, one of them would climb the hill and light a fire so that the boats could find "
    "their way home.",
    "The history of mathematics begins with counting. Long before writing, people kept tallies on bones and "
    "sticks, and the first numbers were simply marks, one for each sheep or each day.",
    "A good recipe for bread needs only four things: flour, water, salt and yeast. The baker's skill lies in "
    "time and temperature, and in knowing when the dough is ready.",
    "The river rose slowly all through the night, and by morning the low fields along its banks had become a "
    "single grey lake, with only the tops of the fences showing where the roads had been.",
]

# The prompts a class is checked on: prose and code, two of them longer than the
# coordinator's 64-token prompt chunk, so that the stock class's one-batch prefill counts.
CLASS_CHECK = [
    "The capital of France is",
    "In the far north, where the winters last for most of the year, a small village of fishermen kept an old "
    "tradition: every evening, one of them would climb the hill and light a fire so that the boats could find "
    "their way home. The fire was built of driftwood and dry heather, and it burned until the last boat had "
    "come in. One winter the fire went out, and on that night",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, counting from zero.\"\"\"\n",
    "Q: What is the boiling point of water at sea level, in degrees Celsius?\nA:",
    "SELECT name, email FROM users WHERE created_at > '2024-01-01' AND",
    "The history of mathematics begins with counting. Long before writing, people kept tallies on bones and "
    "sticks, and the first numbers were simply marks, one for each sheep or each day. Later, in Mesopotamia and "
    "Egypt, scribes needed to measure fields, divide harvests and predict the floods of the rivers. They wrote "
    "their numbers on clay tablets and on papyrus, and some of those tablets survive today, and so",
    "import numpy as np\nimport pandas as pd\n\n# load the measurements and",
    "My grandmother's recipe for bread needs only four things:",
]

# Text that repeats what came before it, the kind speculation from the session's own tokens
# drafts well: code written to a pattern, a schedule, a refrain, a passage copied
REPETITIVE = [
    "def area_of_square(side):\n    return side * side\n\n\ndef area_of_rectangle(width, height):\n    return "
    "width * height\n\n\ndef area_of_triangle(base, height):\n    return base * height / 2\n\n\ndef",
    "Monday: wake up, stretch, run, shower, breakfast.\nTuesday: wake up, stretch, run, shower, breakfast.\n"
    "Wednesday: wake up, stretch, run, shower, breakfast.\nThursday:",
    "Copy the text exactly.\nText: The station opens at six. Trains leave for the coast every hour, and the last "
    "one comes back at midnight. Tickets are sold at the window and on the train.\nCopy: The station opens at six.",
    "Row, row, row your boat, gently down the stream. Merrily, merrily, merrily, merrily, life is but a dream. "
    "Row, row, row your boat, gently down the stream. Merrily, merrily,",
]

# what meshnet bench --prompts chooses from
PROMPT_SETS = {"prose": PROSE, "repetitive": REPETITIVE}
