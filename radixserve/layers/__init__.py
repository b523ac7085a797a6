"""The pieces a model's layers call without knowing how they run: attention backends
(`layers.attention`, planned once per step by the runner) and linear methods
(`layers.linear`, chosen once per engine). Below both the model and the engine.
"""
