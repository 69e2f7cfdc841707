"""The stores: implementations of coordinator.core.storage.Store. ``memory`` keeps everything in this process (the
fast tests of the engine and the service); ``etcd`` is the production store and the only code that knows etcd."""
