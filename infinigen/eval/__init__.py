"""Accuracy, a client of the runtime: every policy scored through the same decode path that serves
tokens. Teacher-forced and greedy decoding (``decoding``), perplexity, few-shot tasks, needles, the
selection's recall, and their plots. The runtime never imports this package."""
