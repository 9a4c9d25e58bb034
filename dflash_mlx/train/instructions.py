"""Prompts closer to real use than the standard-library ones: code instructions in several
languages (tasks, how-tos, classes, SQL, concepts) and chat requests with a format or an
audience. They extend the training pool at its end (``prompts.pool``), so slices reserved
by earlier rounds never move. None is a built-in benchmark prompt (tested).
"""

from __future__ import annotations

import random

LANGS = ["Python", "Python", "Python", "JavaScript", "TypeScript", "Go", "Rust", "C", "Java"]

TASKS = """
checks whether a number is a perfect square; returns the greatest common divisor of two numbers;
counts the vowels in a string; reverses a linked list; finds the second largest number in a list;
checks whether two strings are anagrams; converts a Roman numeral to an integer;
converts an integer to a Roman numeral; rotates a matrix by 90 degrees; transposes a matrix;
returns the prime factors of a number; checks whether a year is a leap year;
computes the factorial of a number iteratively; finds the longest common prefix of a list of strings;
splits a list into chunks of a given size; returns the n most frequent elements of a list;
validates an email address with a regular expression; capitalizes the first letter of every word;
finds all pairs in a list that sum to a target; computes the running average of a list;
merges two sorted lists into one sorted list; checks whether brackets in a string are balanced;
computes the edit distance between two strings; finds the maximum subarray sum;
returns the intersection of two lists; generates all permutations of a string;
generates all subsets of a set; converts a string to snake_case; converts snake_case to camelCase;
parses a query string into a dictionary; computes the median of a list;
finds the missing number in a list from 1 to n; counts the words in a sentence;
truncates a string to a maximum length and adds an ellipsis; removes whitespace from both ends of every line;
checks whether a string contains only digits; converts a binary string to an integer;
formats a number of bytes as a human-readable size; computes the dot product of two vectors;
implements bubble sort; implements quicksort; implements insertion sort; implements merge sort;
returns the Fibonacci numbers up to n; checks whether a number is an Armstrong number;
finds the longest word in a sentence; groups a list of words by their first letter;
computes the distance between two points; checks whether a point lies inside a rectangle;
converts hours and minutes to total minutes; returns the day of the week for a date;
computes compound interest; shuffles a list in place; picks a random element from a list;
flattens a dictionary with nested keys; deep-merges two dictionaries; retries a function call up to three times;
memoizes the results of a function; measures how long a function takes to run;
reads a file and returns its lines without newlines; writes a list of rows to a CSV file;
counts the lines in a text file; returns the file extension of a path; checks whether a string is a valid IPv4 address;
encodes a string with a Caesar cipher; decodes run-length encoded text; compresses a string with run-length encoding;
finds the first non-repeating character in a string; checks whether a list is sorted;
removes the falsy values from a list; zips two lists into a dictionary; inverts a dictionary;
computes the sum of the digits of a number; converts Fahrenheit to Celsius;
returns the nth triangular number; checks whether a sentence is a pangram; pads a number with leading zeros
"""

HOWTOS = """
read a JSON file; sort a dictionary by its values; reverse a string; remove duplicates from a list;
make an HTTP GET request; parse command-line arguments; format a date as YYYY-MM-DD;
get the current time; generate a random number; read a file line by line; write text to a file;
check if a file exists; create a directory; list the files in a directory; copy a file;
split a string by a delimiter; join a list of strings; convert a string to an integer;
handle an exception; define a class with a constructor; iterate over a dictionary;
filter a list; sort a list of objects by a field; find the index of an element in a list;
measure elapsed time; run two tasks concurrently; use a regular expression to find all numbers in a string;
read environment variables; round a number to two decimal places; compare two dates
"""

CLASSES = """
`Stack` with push, pop, peek and is_empty methods; `Queue` with enqueue, dequeue and size methods;
`BankAccount` with deposit, withdraw and balance methods; `Counter` with increment, decrement and reset methods;
`Rectangle` with area and perimeter methods; `Temperature` that converts between Celsius and Fahrenheit;
`TodoList` with add, remove and list methods; `LRUCache` with get and put methods;
`Matrix` with add and multiply methods; `Timer` with start, stop and elapsed methods;
`Inventory` with add_item, remove_item and total_value methods; `Vector2` with add, scale and length methods
"""

SQL_TASKS = """
returns the five most expensive products; counts the orders placed in each month;
finds customers who have never placed an order; returns the average salary per department;
lists employees who earn more than their manager; deletes duplicate rows from a table;
returns the second highest salary; finds the products that were never sold;
counts the users who signed up in the last 30 days; returns each customer's most recent order;
computes a running total of sales by date; finds the top three students in each class
"""

CONCEPTS = """
a list and a tuple; a process and a thread; a stack and a queue; an array and a linked list;
pass by value and pass by reference; synchronous and asynchronous code; an interface and an abstract class;
a shallow copy and a deep copy; compile time and run time; a compiler and an interpreter;
recursion and iteration; a set and a list; a class and an instance; a function and a method
"""

CODE_TEMPLATES = [
    "Write a {lang} function that {task}.",
    "In {lang}, write a function that {task}. Include a short example.",
    "Can you show me {lang} code that {task}?",
]

CHAT_TEMPLATES = [
    "{q} Answer in one sentence.",
    "{q} Keep it short.",
    "Write a haiku about {t}.",
    "Write a limerick about {t}.",
    "Tell me a fun fact about {t}.",
    "Give me three ideas related to {t}.",
    "Explain {t} to a child.",
    "I'm a beginner. How do I get started with {t}?",
    "Write a short thank-you note that mentions {t}.",
    "What are the benefits of {t}?",
]

QUESTIONS = """
Why do leaves change color in autumn?; How do airplanes stay in the air?; What causes rainbows?;
Why do we need sleep?; How does a refrigerator keep food cold?; What makes bread rise?;
Why is the ocean salty?; How do vaccines work?; What is the tallest mountain on Earth?;
Why do cats purr?; How do magnets work?; What is the speed of light?; How do bees make honey?;
Why does the moon change shape?; How do I boil an egg?; What is a good way to save money each month?;
How can I be more productive in the morning?; What should I eat before a run?;
How do I write a good cover letter?; What is the best way to learn to type faster?;
How do I keep my houseplants alive?; What is the difference between a virus and a bacterium?;
How do solar panels make electricity?; Why is exercise good for the brain?;
How do I start a conversation with someone new?; What is a healthy amount of screen time?
"""


def _items(block: str) -> list[str]:
    return [t.strip() for t in block.replace("\n", " ").split(";") if t.strip()]


def code_instructions() -> list[str]:
    """Code requests: tasks and how-tos in several languages, classes, SQL and concepts."""
    out = []
    for i, task in enumerate(_items(TASKS)):
        for k in range(3):
            lang = LANGS[(i * 5 + k * 3) % len(LANGS)]
            out.append(CODE_TEMPLATES[(i + k) % len(CODE_TEMPLATES)].format(lang=lang, task=task))
    for i, how in enumerate(_items(HOWTOS)):
        for k in range(2):
            out.append(f"How do I {how} in {LANGS[(i * 3 + k * 4) % len(LANGS)]}?")
    for i, spec in enumerate(_items(CLASSES)):
        for lang in ("Python", ("JavaScript", "TypeScript", "Java")[i % 3]):
            out.append(f"Write a {lang} class {spec}.")
    out += [f"Write a SQL query that {t}." for t in _items(SQL_TASKS)]
    for i, pair in enumerate(_items(CONCEPTS)):
        lang = ("Python", "Java", "JavaScript", "C")[i % 4]
        out.append(f"Explain the difference between {pair} in {lang}, with a code example.")
    return out


def chat_requests(topics: list[str]) -> list[str]:
    """Chat requests with a format or an audience, over questions and the chat topics."""
    out = []
    for q in _items(QUESTIONS):
        out += [CHAT_TEMPLATES[0].format(q=q), CHAT_TEMPLATES[1].format(q=q), q]
    for i, t in enumerate(topics):
        for k in range(2):
            out.append(CHAT_TEMPLATES[2 + (i + k * 3) % (len(CHAT_TEMPLATES) - 2)].format(t=t))
    return out


def extra_prompts(topics: list[str], exclude: set, seed: int = 1) -> list[str]:
    """Code instructions and chat requests, deduplicated against ``exclude``, interleaved
    reproducibly so every slice of them holds both kinds."""
    from dflash_mlx.bench.prompts import CHAT, CODE

    banned = set(exclude) | set(CODE) | set(CHAT)
    seen, out = set(), []
    for p in code_instructions() + chat_requests(topics):
        if p not in seen and p not in banned:
            seen.add(p)
            out.append(p)
    random.Random(seed).shuffle(out)
    return out


FOLLOW_UPS_CODE = [
    "Can you add comments to that code?",
    "How would you write tests for it?",
    "Can you make it shorter?",
    "What is the time complexity of your solution?",
    "Can you explain how it works, step by step?",
]
FOLLOW_UPS_CHAT = [
    "Can you make that shorter?",
    "Can you explain that in more detail?",
    "Thanks! Can you give me an example?",
    "Can you summarize that in three bullet points?",
    "Can you say that in simpler words?",
]
HISTORY_MAX = 300  # tokens of an earlier answer worth replaying as a first turn


def follow_ups(tokenizer, seqs, eos) -> list[list[dict]]:
    """Two-turn chats: a finished round's own (prompt, answer) as the first turn, then a
    follow-up request. Answers cut at the length limit or longer than ``HISTORY_MAX`` are
    skipped (a truncated first turn is not what users replay).

    Args:
        tokenizer: the target's tokenizer. seqs: (prompt ids, answer ids) pairs in their
            committed order. eos: the end-of-sequence ids.
    """
    out = []
    for i, (p, a) in enumerate(seqs):
        if len(a) == 0 or int(a[-1]) not in eos or len(a) > HISTORY_MAX:
            continue
        text = tokenizer.decode([int(t) for t in p])
        start, end = text.rfind("user\n"), text.rfind("<|im_end|>")
        if start < 0 or end < start:
            continue
        user = text[start + 5 : end].strip()
        answer = tokenizer.decode([int(t) for t in a[:-1]]).strip()
        asks = FOLLOW_UPS_CODE if "```" in answer else FOLLOW_UPS_CHAT
        for k in range(2):
            last = asks[(i + k * 2) % len(asks)]
            out.append(
                [
                    {"role": "user", "content": user},
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": last},
                ]
            )
    return out
