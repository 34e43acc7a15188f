"""A reasoner of our own: a task whose answer needs tokens written long before, a small model
trained on it, and the accuracy of every cache policy at a budget."""
