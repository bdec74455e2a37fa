"""Adapters to serving engines' extension points. Nothing in tiercache imports them."""
