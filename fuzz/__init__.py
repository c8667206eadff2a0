"""The kvfuzz tool: campaigns, replay, shrink, export, the atheris and CrossHair engines."""
