"""``python main.py plan``: every way to train on these devices, forecast, the best of them measured, and the
choice (the simplest of those tied with the fastest) written as a config."""
