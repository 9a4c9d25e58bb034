"""Built-in benchmark prompts: code requests and chat questions written by hand for the
benchmark, none of them produced by the training-prompt builder (``train/prompts.py``)."""

from __future__ import annotations

CODE = [
    (
        "Write a Python function that checks whether a string is a palindrome, ignoring case "
        "and punctuation."
    ),
    "Write a Python function `merge_intervals(intervals)` that merges overlapping intervals.",
    'def fizzbuzz(n):\n    """Return a list of the FizzBuzz strings from 1 to n."""\n',
    "Write a Python class `Stack` with push, pop, peek and is_empty methods.",
    (
        'def count_words(text):\n    """Return a dict mapping each word in text to how often it '
        'occurs."""\n'
    ),
    "Write a Python function that returns the n-th Fibonacci number using memoization.",
    "How do I read a CSV file and compute the average of one column in Python?",
    'def flatten(nested):\n    """Flatten an arbitrarily nested list of lists into one list."""\n',
    "Write a Python function that removes duplicates from a list while keeping the order.",
    "Explain the difference between a list and a tuple in Python, with a code example.",
    (
        "Write a Python function `binary_search(items, target)` that returns the index of "
        "target or -1."
    ),
    'def is_prime(n):\n    """Return True if n is a prime number."""\n',
    "Write a JavaScript function that reverses the words in a sentence.",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "Write a Python script that prints the 20 most common words in a text file.",
    'def celsius_to_fahrenheit(c):\n    """Convert a temperature from Celsius to Fahrenheit."""\n',
]

CHAT = [
    "What is the capital of France? Answer in one sentence.",
    "Give me three ideas for a rainy Sunday afternoon.",
    "Why is the sky blue?",
    "Write a haiku about autumn leaves.",
    "How do I make a good cup of coffee at home?",
    "What are some tips for staying focused while studying?",
    "Explain what a computer virus is to a child.",
    "Write a short thank-you note to a teacher.",
    "What should I pack for a weekend hiking trip?",
    "What is the difference between weather and climate?",
    "Suggest a simple dinner recipe with chicken and rice.",
    "How can I improve my sleep?",
    "Tell me a fun fact about octopuses.",
    "What are the benefits of learning a second language?",
    "Write a limerick about a cat who loves to code.",
    "How does a bicycle stay upright when it moves?",
]


def builtin(name: str) -> list[str]:
    """The built-in prompt set ``code``, ``chat`` or ``mixed`` (both, interleaved)."""
    if name == "code":
        return list(CODE)
    if name == "chat":
        return list(CHAT)
    mixed = []
    for a, b in zip(CODE, CHAT):
        mixed += [a, b]
    return mixed
