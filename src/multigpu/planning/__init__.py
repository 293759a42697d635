"""``python main.py plan``: every way to train on these devices, predicted, the best of them measured, and the
choice (the simplest of those tied with the fastest) written as a config."""
