"""Generation: the engine, its static compressed cache, sampling and model loading."""
