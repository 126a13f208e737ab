"""Real-text prompts for a demo that serves a real checkpoint (``kvpool demo --model``).

Each request of the replay is one user turn of a chat (the server renders it with the
checkpoint's own chat template). Request ``index`` always gets the same question, so the
static and elastic runs serve identical inputs; with greedy decoding they also get the
same answers (up to floating-point differences between batch shapes).
"""

from __future__ import annotations

QUESTIONS = (
    "Why is the sky blue?",
    "Explain how a rainbow forms.",
    "What are three tips for learning to cook at home?",
    "Describe the water cycle in a few sentences.",
    "How do airplanes stay in the air?",
    "What is photosynthesis?",
    "Give me a simple recipe for pancakes.",
    "What is the difference between weather and climate?",
    "Write a short poem about the sea.",
    "How does a refrigerator keep food cold?",
    "What should I pack for a weekend hiking trip?",
    "Why do we have seasons on Earth?",
    "Explain what a computer program is to a child.",
    "What are the health benefits of walking every day?",
    "How do bees make honey?",
    "Suggest three names for a friendly robot.",
    "What causes thunder and lightning?",
    "How can I improve my sleep?",
    "What is the capital of France, and what is it known for?",
    "Explain why the Moon has phases.",
    "What is a good way to start learning to play the guitar?",
    "Why do leaves change color in autumn?",
    "Describe how a train works.",
    "What are some ways to save water at home?",
)


def question(index: int) -> str:
    """The question of request ``index`` of a replay (the same in every run)."""
    return QUESTIONS[(index * 7) % len(QUESTIONS)]


def chat_messages(index: int) -> list[dict[str, str]]:
    """The ``messages`` of request ``index``: one user turn, no system turn (the
    checkpoint's template adds its default one if it has one)."""
    return [{"role": "user", "content": question(index)}]
