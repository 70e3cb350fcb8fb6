"""Shipped beside deps_handler.py by --extra-files."""


def shout(text):
    return {"shouted": str(text).upper(), "helper": __name__}
