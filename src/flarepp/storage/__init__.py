"""Run storage: the run configuration and its format versions, checkpoint reading and writing,
run directories and their locks, and the one way to rebuild a trained model.

This floor sits above the data and the models and below the tasks: it knows how a run is
stored, not what a run learns.
"""
