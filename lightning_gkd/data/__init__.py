"""Data: sources, row validation, chat-ML collation, the DataModule and the bundled toy task."""
