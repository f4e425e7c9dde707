"""The server's routes, one module per concern; each handler reads the engine and the settings from
``app.state`` (``routes/state.py``), so a test can mount one router on an app of its own."""
