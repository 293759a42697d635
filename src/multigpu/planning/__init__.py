"""``python main.py plan``: every way to train on these devices, measured, ranked, and the fastest written as a
config."""
