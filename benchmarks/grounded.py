"""Grounded prompts for the speculation benchmarks (issue 29): chat requests whose answers
repeat their input, the text jobs people queue (copy a passage, edit a function, answer from a
given text). Fixed here, so that every run and every contestant reads the same prompts."""

from __future__ import annotations

PASSAGE = (
    "The river town kept its records in a ledger that every keeper copied by hand. Each page "
    "listed the weather of the day, the price of grain at the market, the boats that passed "
    "the lock and the names of their captains. When a page was full the keeper read it aloud "
    "in the square, and anyone who found a mistake could ask for it to be corrected before "
    "the ink was dry. In the spring of the flood year the ledger was carried to the church "
    "tower, and it stayed there until the water went down three weeks later."
)

CODE = '''def area(width, height):
    """Return the area of a rectangle."""
    if width < 0 or height < 0:
        raise ValueError("width and height must be >= 0")
    return width * height


def perimeter(width, height):
    """Return the perimeter of a rectangle."""
    if width < 0 or height < 0:
        raise ValueError("width and height must be >= 0")
    return 2 * (width + height)
'''

TASKS = [
    "Copy the following passage exactly, word for word.\n\n" + PASSAGE,
    "Rename the parameter `width` to `w` in this code and return the whole code.\n\n" + CODE,
    "Using only the text below, say what the keeper did with each page and where the ledger went "
    "in the flood year. Quote the text.\n\n" + PASSAGE,
    "Add type hints (float) to every parameter and return value of this code and return the whole code.\n\n" + CODE,
]


def grounded_prompts(hf_dir: str, count: int) -> list[list[int]]:
    """`count` chat-templated prompts as token ids (the tasks in turn)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    out = []
    for i in range(count):
        msgs = [{"role": "user", "content": TASKS[i % len(TASKS)]}]
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        out.append(tok.encode(text, add_special_tokens=False))
    return out
