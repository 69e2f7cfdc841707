"""Client for the Inbox Coordinator: claims on email replies, so that an agent never replies twice."""
