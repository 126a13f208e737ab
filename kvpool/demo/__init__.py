"""The main job: several models on one device, static partitions vs elastic sharing."""
