"""The model registry: push pipeline, MNN conversion and validation in a child process."""
