from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AllocatableResourcesRequest(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...

class AllocatableResourcesResponse(_message.Message):
    __slots__ = ["cpu_ids", "devices", "memory"]
    CPU_IDS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    cpu_ids: _containers.RepeatedScalarFieldContainer[int]
    devices: _containers.RepeatedCompositeFieldContainer[ContainerDevices]
    memory: _containers.RepeatedCompositeFieldContainer[ContainerMemory]
    def __init__(self, devices: _Optional[_Iterable[_Union[ContainerDevices, _Mapping]]] = ..., cpu_ids: _Optional[_Iterable[int]] = ..., memory: _Optional[_Iterable[_Union[ContainerMemory, _Mapping]]] = ...) -> None: ...

class ContainerDevices(_message.Message):
    __slots__ = ["device_ids", "resource_name", "topology"]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    RESOURCE_NAME_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    device_ids: _containers.RepeatedScalarFieldContainer[str]
    resource_name: str
    topology: TopologyInfo
    def __init__(self, resource_name: _Optional[str] = ..., device_ids: _Optional[_Iterable[str]] = ..., topology: _Optional[_Union[TopologyInfo, _Mapping]] = ...) -> None: ...

class ContainerMemory(_message.Message):
    __slots__ = ["memory_type", "size", "topology"]
    MEMORY_TYPE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    memory_type: str
    size: int
    topology: TopologyInfo
    def __init__(self, memory_type: _Optional[str] = ..., size: _Optional[int] = ..., topology: _Optional[_Union[TopologyInfo, _Mapping]] = ...) -> None: ...

class NUMANode(_message.Message):
    __slots__ = ["ID"]
    ID: int
    ID_FIELD_NUMBER: _ClassVar[int]
    def __init__(self, ID: _Optional[int] = ...) -> None: ...

class TopologyInfo(_message.Message):
    __slots__ = ["nodes"]
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NUMANode]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NUMANode, _Mapping]]] = ...) -> None: ...
